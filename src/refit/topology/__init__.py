"""Topology: who talks to whom (the Sender and Receiver sessions, per-rank colocated refits) and the
verification step their data paths run."""
