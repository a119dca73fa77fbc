"""Provisioning of the real models the tests, benchmarks and examples use, with no hub (provision.py), and their
prompts (prompts.py). The library imports it only to resolve a provisioned name."""
