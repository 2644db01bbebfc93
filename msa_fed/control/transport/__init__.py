"""Addresses, the one channel builder (TLS, mutual TLS, loopback plaintext) and certificate checks."""
