"""Drafters: propose tokens that the target verifies exactly (see base.py for the interface)."""
