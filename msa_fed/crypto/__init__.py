"""Cryptography of the federation: sealed, signed job traffic (standard constructions of ``cryptography``)."""
