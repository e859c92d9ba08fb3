"""gRPC server exposing the engine."""
