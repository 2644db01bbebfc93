"""A site's own privacy policy: rules, budgets, audit log and differential privacy.

Depends only on numpy, scipy, msa_fed.core and msa_fed.errors (no Ray, no gRPC), so every
runtime's site process enforces the same code.  See docs/DESIGN.md, "Site privacy policy".
"""
