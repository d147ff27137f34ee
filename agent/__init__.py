"""Berth's node agent: discovers what its GPU host has and makes each booked share real on it."""
