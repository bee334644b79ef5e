"""Anthropic's Messages API (``/v1/messages``) on the server's chat path."""
