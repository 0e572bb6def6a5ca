"""The engine: one step loop on its own thread, fed requests by the server."""
