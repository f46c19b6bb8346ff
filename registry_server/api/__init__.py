"""The gRPC edge and the server's wiring: servicer, auth, metrics, configuration, start-up."""
