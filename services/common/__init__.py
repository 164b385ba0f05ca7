"""Pieces every service's entry point shares."""
