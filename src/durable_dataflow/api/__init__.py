"""The HTTP API and the web operator view: a thin shell over the run service and the Ops projection."""
