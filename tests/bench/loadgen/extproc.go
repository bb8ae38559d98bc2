package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
)

const destinationHeader = "x-gateway-destination-endpoint"

// ExtProcResult is what the extproc mode reports.
type ExtProcResult struct {
	Mode            string           `json:"mode"`
	Target          string           `json:"target"`
	Concurrency     int              `json:"concurrency"`
	Connections     int              `json:"connections"`
	ResponseHeaders bool             `json:"response_headers"`
	Streams         int64            `json:"streams"`
	Errors          int64            `json:"errors"`
	FirstError      string           `json:"first_error,omitempty"`
	Replies         map[string]int64 `json:"replies"`
	Seconds         float64          `json:"seconds"`
	PerSecond       float64          `json:"streams_per_second"`
	// From opening the stream to the reply to the request headers (the routing decision).
	Decision Percentiles `json:"decision_latency"`
	// From opening the stream to its OK status.
	Stream Percentiles `json:"stream_latency"`
}

type streamTotals struct {
	mu        sync.Mutex
	decisions []time.Duration
	streams   []time.Duration
	routed    int64
	continued int64
	immediate int64
	errors    int64
	first     error
}

func runExtProc(args []string) (*ExtProcResult, error) {
	fs := flag.NewFlagSet("extproc", flag.ContinueOnError)
	target := fs.String("target", "", "ext_proc server, host:port")
	concurrency := fs.Int("concurrency", 64, "streams open at once")
	connections := fs.Int("connections", 1, "HTTP/2 connections (Envoy uses one per worker thread)")
	total := fs.Int64("streams", 20000, "streams to complete at most")
	duration := fs.Duration("duration", 10*time.Second, "time to run at most")
	warmup := fs.Int("warmup", 500, "streams before the measurement, not counted")
	keysFile := fs.String("keys-file", "", "affinity keys, one per line (none: no key header)")
	keyHeader := fs.String("key-header", "x-affinity-key", "header carrying the key")
	responseHeaders := fs.Bool("response-headers", true,
		"send response headers after the request headers reply, as Envoy does with response_header_mode SEND")
	timeout := fs.Duration("stream-timeout", 10*time.Second, "deadline of one stream")
	parse := commonFlags(fs)
	if err := parse(args); err != nil {
		return nil, err
	}
	if *target == "" {
		return nil, errors.New("-target is required")
	}
	if *concurrency < 1 || *connections < 1 {
		return nil, errors.New("-concurrency and -connections must be at least 1")
	}
	keys, err := readKeys(*keysFile)
	if err != nil {
		return nil, err
	}
	clients := make([]extprocv3.ExternalProcessorClient, *connections)
	for i := range clients {
		conn, err := grpc.NewClient(*target, grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			return nil, err
		}
		defer conn.Close()
		conn.Connect()
		clients[i] = extprocv3.NewExternalProcessorClient(conn)
	}
	s := &streamer{keys: keys, keyHeader: *keyHeader, responseHeaders: *responseHeaders, timeout: *timeout}

	// Warm-up: connections, the server's code paths and caches.
	var next atomic.Int64
	run := func(limit int64, deadline time.Time, totals *streamTotals) {
		var wg sync.WaitGroup
		for w := 0; w < *concurrency; w++ {
			wg.Add(1)
			go func(w int) {
				defer wg.Done()
				client := clients[w%len(clients)]
				for time.Now().Before(deadline) {
					i := next.Add(1) - 1
					if i >= limit {
						return
					}
					s.one(client, int(i), totals)
				}
			}(w)
		}
		wg.Wait()
	}
	warm := &streamTotals{}
	run(int64(*warmup), time.Now().Add(*duration), warm)
	if warm.errors > 0 && warm.errors == int64(*warmup) {
		return nil, fmt.Errorf("every warm-up stream failed: %v", warm.first)
	}

	next.Store(0)
	totals := &streamTotals{}
	started := time.Now()
	run(*total, started.Add(*duration), totals)
	elapsed := time.Since(started).Seconds()

	result := &ExtProcResult{
		Mode:            "extproc",
		Target:          *target,
		Concurrency:     *concurrency,
		Connections:     *connections,
		ResponseHeaders: *responseHeaders,
		Streams:         int64(len(totals.streams)),
		Errors:          totals.errors,
		Replies: map[string]int64{
			"routed": totals.routed, "continue": totals.continued, "immediate_response": totals.immediate,
		},
		Seconds:   round(elapsed, 3),
		PerSecond: round(float64(len(totals.streams))/elapsed, 1),
		Decision:  percentiles(totals.decisions),
		Stream:    percentiles(totals.streams),
	}
	if totals.first != nil {
		result.FirstError = totals.first.Error()
	}
	return result, nil
}

type streamer struct {
	keys            []string
	keyHeader       string
	responseHeaders bool
	timeout         time.Duration
}

func header(key, value string) *corev3.HeaderValue {
	return &corev3.HeaderValue{Key: key, RawValue: []byte(value)}
}

// requestHeaders is the first message Envoy sends for a POST with a body and body mode NONE.
func (s *streamer) requestHeaders(i int) *extprocv3.ProcessingRequest {
	headers := []*corev3.HeaderValue{
		header(":authority", "gateway"),
		header(":path", "/v1/chat/completions"),
		header(":method", "POST"),
		header(":scheme", "http"),
		header("content-type", "application/json"),
		header("content-length", "96"),
		header("user-agent", "loadgen"),
		header("x-forwarded-proto", "http"),
		header("x-request-id", fmt.Sprintf("00000000-0000-4000-8000-%012d", i)),
	}
	if key := s.keys[i%len(s.keys)]; key != "" {
		headers = append(headers, header(s.keyHeader, key))
	}
	return &extprocv3.ProcessingRequest{
		Request: &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: &extprocv3.HttpHeaders{
			Headers: &corev3.HeaderMap{Headers: headers},
		}},
		ProtocolConfig: &extprocv3.ProtocolConfiguration{
			RequestBodyMode:  filterv3.ProcessingMode_NONE,
			ResponseBodyMode: filterv3.ProcessingMode_NONE,
		},
	}
}

func responseHeaders() *extprocv3.ProcessingRequest {
	return &extprocv3.ProcessingRequest{
		Request: &extprocv3.ProcessingRequest_ResponseHeaders{ResponseHeaders: &extprocv3.HttpHeaders{
			Headers: &corev3.HeaderMap{Headers: []*corev3.HeaderValue{
				header(":status", "200"),
				header("content-type", "application/json"),
				header("content-length", strconv.Itoa(120)),
				header("date", "Thu, 01 Jan 2026 00:00:00 GMT"),
				header("x-envoy-upstream-service-time", "1"),
			}},
		}},
	}
}

// one runs a stream the way Envoy does: request headers, the reply, response headers, the
// reply, then the half-close, and waits for the server's status.
func (s *streamer) one(client extprocv3.ExternalProcessorClient, i int, totals *streamTotals) {
	ctx, cancel := context.WithTimeout(context.Background(), s.timeout)
	defer cancel()
	started := time.Now()
	kind, decided, err := s.exchange(ctx, client, i, started)
	elapsed := time.Since(started)
	totals.mu.Lock()
	defer totals.mu.Unlock()
	if err != nil {
		totals.errors++
		if totals.first == nil {
			totals.first = err
		}
		return
	}
	switch kind {
	case "routed":
		totals.routed++
	case "immediate":
		totals.immediate++
	default:
		totals.continued++
	}
	totals.decisions = append(totals.decisions, decided)
	totals.streams = append(totals.streams, elapsed)
}

func (s *streamer) exchange(
	ctx context.Context, client extprocv3.ExternalProcessorClient, i int, started time.Time,
) (string, time.Duration, error) {
	stream, err := client.Process(ctx)
	if err != nil {
		return "", 0, err
	}
	if err := stream.Send(s.requestHeaders(i)); err != nil {
		return "", 0, err
	}
	reply, err := stream.Recv()
	if err != nil {
		return "", 0, err
	}
	decided := time.Since(started)
	kind := "continue"
	switch {
	case reply.GetImmediateResponse() != nil:
		// Envoy ends the request here.
		kind = "immediate"
	case reply.GetRequestHeaders() != nil:
		for _, h := range reply.GetRequestHeaders().GetResponse().GetHeaderMutation().GetSetHeaders() {
			if h.GetHeader().GetKey() == destinationHeader {
				kind = "routed"
			}
		}
	default:
		return "", 0, fmt.Errorf("unexpected reply to request headers: %v", reply)
	}
	if kind != "immediate" && s.responseHeaders {
		if err := stream.Send(responseHeaders()); err != nil {
			return "", 0, err
		}
		reply, err := stream.Recv()
		if err != nil {
			return "", 0, err
		}
		if reply.GetResponseHeaders() == nil {
			return "", 0, fmt.Errorf("unexpected reply to response headers: %v", reply)
		}
	}
	if err := stream.CloseSend(); err != nil {
		return "", 0, err
	}
	if _, err := stream.Recv(); !errors.Is(err, io.EOF) {
		if err == nil {
			err = errors.New("a reply after the last message")
		}
		return "", 0, err
	}
	return kind, decided, nil
}
