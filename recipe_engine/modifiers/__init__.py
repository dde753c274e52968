"""Built-in modifiers: one file per modifier, each registered with ``@register``."""
