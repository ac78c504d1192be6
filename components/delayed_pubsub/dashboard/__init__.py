"""The operator dashboard (`delayed-pubsub dashboard`): a server-rendered web UI of one app's
delayed messages, live by Server-Sent Events, read-only unless actions are allowed.

Modules: `source` (every Redis read and action, over the operator CLI's Inspector),
`poller` (one shared snapshot per process), `guard` (token, session, CSRF, Origin),
`pages` and `actions` (the HTML routes), `api` (the same as JSON, /api/v1),
`app` (puts them together), `cli` (the command).
"""
