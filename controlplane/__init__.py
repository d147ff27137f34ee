"""Berth's control plane: the booking calendar, quota, IAM drafts and the tenant HTTP API."""
