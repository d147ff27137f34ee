"""The agent's side of the kubelet: the device plugin that offers booked GPUs (plugin), who holds them (podresources),
the Node's release-stuck taint (taint), and the code generated for both kubelet gRPC APIs (proto/, gen/, regen.sh)."""
