"""Integrations: refit inside other systems (vLLM), above the topology they drive."""
