"""The parameter-server strategy (`--strategy ps`): servers, worker client, sharding, protocol."""
