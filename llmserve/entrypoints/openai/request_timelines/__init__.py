"""``GET /v1/requests`` and ``GET /v1/requests/{id}/timeline`` (issue 33), and the
middleware that labels each HTTP request for them (tenant, ids, trace headers)."""
