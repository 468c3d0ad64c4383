"""A user's package for the tests: the code a job names by import path ("userpkg.bags:mlp").
Each module is one test area's; the tests put tests/ on the PYTHONPATH of the runs."""
