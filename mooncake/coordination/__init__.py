"""Coordination through etcd (``[coordination]``): conductors campaign for the lead with etcd's
election service (``election``), everyone else follows the leader it names; the client speaks
etcd's HTTP/JSON gateway (``etcd``)."""
