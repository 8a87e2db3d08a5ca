"""`refit bench`: the floor, refit and the baselines measured side by side in one run."""
