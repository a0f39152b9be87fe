"""The statistics and the rule table: pure numpy, no engine, no config."""
