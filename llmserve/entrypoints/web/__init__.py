"""The built-in page (issue 33): the chat playground at ``/`` and the live view at
``/live``, static files shipped in the package (:mod:`.webui`)."""
