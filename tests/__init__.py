"""The test suite in three tiers, each runnable alone (scripts/test --fast, --processes, --cluster).

The helpers beside this file (cli_helpers, dist_helpers, hf_helpers; data/, golden/) serve every
tier; conftest.py puts this folder on sys.path, so they are imported by their plain names.
"""
