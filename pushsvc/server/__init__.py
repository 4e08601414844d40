"""The daemon: lifecycle, listeners, the push service and its progress loop."""
