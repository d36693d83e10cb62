"""Each party as a service of its own, configured by its own TOML file (issue 16,
docs/deploy.md): `config.py` the files' schema and checks, `init.py` `gputravel cohort init`,
`status.py` `gputravel status`, `engine.py` a config turned into the engine's."""
