"""Shepherd: a bare-metal fleet manager on Temporal."""
