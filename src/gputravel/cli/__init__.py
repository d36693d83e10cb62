"""The command line: `gputravel ...`."""
