"""The operator dashboard (`delayed-pubsub dashboard`): a server-rendered web UI of one app's
delayed messages, live by Server-Sent Events, read-only unless actions are allowed.

Modules: `source` (every Redis read and action, over the operator CLI's Inspector),
`poller` (one shared snapshot per process), `guard` (token, session, CSRF, Origin),
`app` (routes and pages), `cli` (the command).
"""
