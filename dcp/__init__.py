"""DCP change-streaming server and client."""
