"""The site registry: records, tokens, the store (memory, SQLite), the service, its gRPC servicer and client."""
