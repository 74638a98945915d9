// Consumes N messages with Watermill's redisstream subscriber (consumer
// group, ack per message, trivial handler) and prints the rate. The messages
// are published first with Watermill's own publisher (its wire format), and
// only consumption is timed.
//
//	go run . -addr 127.0.0.1:6379 -n 50000
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-redisstream/pkg/redisstream"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/redis/go-redis/v9"
)

func main() {
	addr := flag.String("addr", "127.0.0.1:6379", "redis address")
	n := flag.Int("n", 50000, "messages")
	flag.Parse()
	client := redis.NewClient(&redis.Options{Addr: *addr})
	logger := watermill.NopLogger{}
	topic := fmt.Sprintf("wm-%d", time.Now().UnixNano())

	pub, err := redisstream.NewPublisher(redisstream.PublisherConfig{Client: client}, logger)
	if err != nil {
		fail(err)
	}
	batch := make([]*message.Message, 0, 1000)
	for i := 0; i < *n; i++ {
		batch = append(batch, message.NewMessage(watermill.NewUUID(), []byte(fmt.Sprintf(`{"order_id":%d,"amount_cents":100}`, i))))
		if len(batch) == cap(batch) || i == *n-1 {
			if err := pub.Publish(topic, batch...); err != nil {
				fail(err)
			}
			batch = batch[:0]
		}
	}

	sub, err := redisstream.NewSubscriber(redisstream.SubscriberConfig{
		Client:        client,
		ConsumerGroup: "bench",
		OldestId:      "0",
	}, logger)
	if err != nil {
		fail(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	start := time.Now()
	msgs, err := sub.Subscribe(ctx, topic)
	if err != nil {
		fail(err)
	}
	for i := 0; i < *n; i++ {
		m := <-msgs
		m.Ack()
	}
	took := time.Since(start)
	fmt.Printf("watermill redisstream: %d messages in %s = %.0f msg/s\n", *n, took, float64(*n)/took.Seconds())
}

func fail(err error) {
	fmt.Fprintln(os.Stderr, err)
	os.Exit(1)
}
