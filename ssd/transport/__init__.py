"""How the target and the draft talk: one Channel interface, several carriers."""

from ssd.transport.channel import Channel, ChannelClosed, ChannelTimeout, Message
from ssd.transport.distributed import DistributedChannel
from ssd.transport.inprocess import inprocess_pair

__all__ = ["Channel", "ChannelClosed", "ChannelTimeout", "DistributedChannel", "Message", "inprocess_pair"]
