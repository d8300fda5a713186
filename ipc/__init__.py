"""Inter-process plumbing: message types, ZeroMQ socket helpers, process start/stop."""
