"""moe-serve load tests: scenarios, a Locust user, an asyncio client, and the report."""
