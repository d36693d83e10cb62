"""The red team: the paper's attackers (section 6) built as real code and run against a live
cohort. See docs/security.md and `gputravel redteam`."""

from gputravel.redteam.run import AttackResult, RedTeamReport, run_redteam

__all__ = ["AttackResult", "RedTeamReport", "run_redteam"]
