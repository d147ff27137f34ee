"""Berth's front door: the `berth` command (main.py), the tenant CLI (cli/) and the Python client (client/).

This package sits on top of the import graph: it dispatches into the
control plane and the agent, and the tenant CLI is built on the typed client.
Nothing below (agent, cgroups, controlplane, common) imports it.
"""
