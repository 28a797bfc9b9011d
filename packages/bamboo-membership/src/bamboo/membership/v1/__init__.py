"""Generated protobuf and gRPC stubs of `proto/bamboo/membership/v1/` (regenerate with `make proto`)."""
