"""Each party as a service of its own, configured by its own TOML file (issue 16, docs/deploy.md)."""
