"""Tools that drive specwire from above: `specwire bench`, `specwire experiment`, trace summaries.

Not part of the SDK: `specwire.client` imports nothing from here.
"""
