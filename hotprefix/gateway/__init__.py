"""The multi-tenant gateway: tenants and keys, forced system prompts, cache salts,
rate limits, usage, warm-up and prefix-affinity routing over several backends."""
