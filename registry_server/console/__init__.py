"""The approval console (``toolreg console``): a web page where approvers see,
live, the requests they may approve, read each in full, and sign it in their
own browser with their own key (WebCrypto; the key never leaves the page).

``settings`` checks what it may serve, ``sessions`` holds who signed in,
``feed`` shares one registry watch per approver among its open pages,
``views`` shapes (and escapes) what the page shows, ``app`` serves it all,
and ``static/`` is the page itself. docs/how-to/approvals.md describes it.
"""
