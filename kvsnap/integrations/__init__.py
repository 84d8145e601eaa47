"""Adapters that put kvsnap snapshots into other servers' prefix caches."""
