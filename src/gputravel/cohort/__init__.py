"""Launching a cohort: the supervisor that owns every process, links, trust setup, isolation."""
