"""What a chat reply is made of beyond text: reasoning and tool calls, and the parsers families declare for them."""
