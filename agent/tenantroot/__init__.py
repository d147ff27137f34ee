"""Tenant root on bare metal (`binding: node`): what the agent changes on the node to hand it over and take it back.

The package owns four things and nothing else:

- `authorized_keys`: the agent-owned keys directory sshd reads
  (`AuthorizedKeysFile <--ssh-keys-dir>/%u`): the tenant's public keys per
  user, each line with `expiry-time` at the window's end, so sshd refuses
  them by itself even if the agent is dead; written atomically, with the
  ownership and modes sshd's StrictModes accepts.
- `hostkeys`: the host's SSH host key fingerprints (`--ssh-host-keys`) and
  the `ssh` endpoint a binding reports (`--ssh-endpoint`).
- `sessions`: the process baseline taken at the hand-over and the end of
  every session and process that came from the tenant's keys at the
  hand-back (what it can and cannot guarantee is in its docstring).
- `notice`: a message to the tenant's login terminals (the warning before
  the reservation ends).

Cleaning the node afterwards (and the out-of-band reset for
`cleaning: redfish`, which lives in `controlplane.bmc`) is not here.
"""
