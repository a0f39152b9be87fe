"""The pytest side: the rule tests, the session, the hooks that feed the reports."""
