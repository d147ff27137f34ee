"""The domain core: plain synchronous code over plain data, standard library only.

Nothing here knows about HTTP, SQL or asyncio, so placement, quota and the
reservation state machine are tested directly and fast.
"""
