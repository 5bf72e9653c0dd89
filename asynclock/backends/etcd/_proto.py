"""etcd's message classes, built at import from ``_descriptor.py`` in a private pool."""

from __future__ import annotations

from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from ._descriptor import DESCRIPTOR_SET

_pool = descriptor_pool.DescriptorPool()
for _file in descriptor_pb2.FileDescriptorSet.FromString(DESCRIPTOR_SET).file:
    _pool.Add(_file)


def _message(name: str) -> Any:
    return message_factory.GetMessageClass(_pool.FindMessageTypeByName(f"asynclock.etcd.{name}"))


ResponseHeader: Any = _message("ResponseHeader")
KeyValue: Any = _message("KeyValue")
Event: Any = _message("Event")
RangeRequest: Any = _message("RangeRequest")
RangeResponse: Any = _message("RangeResponse")
PutRequest: Any = _message("PutRequest")
DeleteRangeRequest: Any = _message("DeleteRangeRequest")
DeleteRangeResponse: Any = _message("DeleteRangeResponse")
RequestOp: Any = _message("RequestOp")
Compare: Any = _message("Compare")
TxnRequest: Any = _message("TxnRequest")
TxnResponse: Any = _message("TxnResponse")
CompactionRequest: Any = _message("CompactionRequest")
CompactionResponse: Any = _message("CompactionResponse")
WatchRequest: Any = _message("WatchRequest")
WatchCreateRequest: Any = _message("WatchCreateRequest")
WatchCancelRequest: Any = _message("WatchCancelRequest")
WatchProgressRequest: Any = _message("WatchProgressRequest")
WatchResponse: Any = _message("WatchResponse")
LeaseGrantRequest: Any = _message("LeaseGrantRequest")
LeaseGrantResponse: Any = _message("LeaseGrantResponse")
LeaseRevokeRequest: Any = _message("LeaseRevokeRequest")
LeaseRevokeResponse: Any = _message("LeaseRevokeResponse")
LeaseKeepAliveRequest: Any = _message("LeaseKeepAliveRequest")
LeaseKeepAliveResponse: Any = _message("LeaseKeepAliveResponse")
LeaseTimeToLiveRequest: Any = _message("LeaseTimeToLiveRequest")
LeaseTimeToLiveResponse: Any = _message("LeaseTimeToLiveResponse")
AuthenticateRequest: Any = _message("AuthenticateRequest")
AuthenticateResponse: Any = _message("AuthenticateResponse")
StatusRequest: Any = _message("StatusRequest")
StatusResponse: Any = _message("StatusResponse")

#: Enum values used on the wire.
SORT_ASCEND = 1
SORT_DESCEND = 2
SORT_TARGET_CREATE = 2
CMP_EQUAL = 0
CMP_GREATER = 1
CMP_LESS = 2
CMP_TARGET_CREATE = 1
CMP_TARGET_MOD = 2
CMP_TARGET_VALUE = 3
EVENT_DELETE = 1
