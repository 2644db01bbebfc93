"""Operations over the registry's store: jobs, model versions, site status; the servicer, client and commands."""
