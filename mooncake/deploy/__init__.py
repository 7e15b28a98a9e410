"""Deployment renderers (``mooncake deploy``)."""
