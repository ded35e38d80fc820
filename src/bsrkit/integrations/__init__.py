"""Optional adapters to other libraries. Each imports its library when it is imported itself; ``import
bsrkit`` imports none of them."""
