// The floor of a pluggable pub/sub through daprd, in Go: bench/bare_pubsub.py's twin, to show
// whether the limit is daprd's pluggable path itself or the component's language.
//
//	bare-go SOCKET N
//
// Serves dapr's PubSub service (the same proto, from dapr/dapr's generated code) with
// reflection on the unix socket SOCKET. Init, Features and Ping answer at once; PullMessages
// sends N messages built before the stream opens, and reads and drops daprd's acks.
package main

import (
	"context"
	"fmt"
	"net"
	"os"
	"strconv"

	proto "github.com/dapr/dapr/pkg/proto/components/v1"
	"google.golang.org/grpc"
	"google.golang.org/grpc/reflection"
)

// The CloudEvent of bench/common.py's PAYLOAD (the same bytes the other backlogs carry).
var payload = []byte(`{"specversion": "1.0", "id": "5929aaac-a5e2-4ca1-859c-edfe73f11565", "source": "bench", ` +
	`"type": "com.dapr.event.sent", "datacontenttype": "application/json", "data": {"orderId": 66, ` +
	`"item": "xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx"}, "topic": "orders", ` +
	`"pubsubname": "delayed"}`)

type bare struct {
	proto.UnimplementedPubSubServer
	n int
}

func (b *bare) Init(context.Context, *proto.PubSubInitRequest) (*proto.PubSubInitResponse, error) {
	return &proto.PubSubInitResponse{}, nil
}

func (b *bare) Features(context.Context, *proto.FeaturesRequest) (*proto.FeaturesResponse, error) {
	return &proto.FeaturesResponse{}, nil
}

func (b *bare) Ping(context.Context, *proto.PingRequest) (*proto.PingResponse, error) {
	return &proto.PingResponse{}, nil
}

func (b *bare) PullMessages(stream proto.PubSub_PullMessagesServer) error {
	first, err := stream.Recv()
	if err != nil {
		return err
	}
	topic := first.GetTopic().GetName()
	messages := make([]*proto.PullMessagesResponse, b.n)
	for i := range messages {
		messages[i] = &proto.PullMessagesResponse{
			Data: payload, TopicName: topic, Id: strconv.Itoa(i + 1), ContentType: "application/cloudevents+json",
		}
	}
	done := make(chan error, 1)
	go func() {
		for {
			if _, err := stream.Recv(); err != nil {
				done <- err
				return
			}
		}
	}()
	for _, m := range messages {
		if err := stream.Send(m); err != nil {
			return err
		}
	}
	<-done
	return nil
}

func main() {
	if len(os.Args) != 3 {
		fmt.Fprintln(os.Stderr, "usage: bare-go SOCKET N")
		os.Exit(2)
	}
	n, err := strconv.Atoi(os.Args[2])
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	_ = os.Remove(os.Args[1])
	lis, err := net.Listen("unix", os.Args[1])
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	server := grpc.NewServer()
	proto.RegisterPubSubServer(server, &bare{n: n})
	reflection.Register(server)
	if err := server.Serve(lis); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}
